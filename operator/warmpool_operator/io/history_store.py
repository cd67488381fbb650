"""One WarmModel's request history kept in a ConfigMap it owns, so a restarted operator does not start from zero.

* **Where**: ConfigMap ``<warmmodel>-history`` (:func:`history_configmap_name`, the one place the
  name is made) in the WarmModel's namespace, key ``history``, holding :func:`.history.dumps`'s
  text; owned by the WarmModel (controller owner reference: it goes when the WarmModel goes).
  Its labels say what it is (model, name, instance, component ``history``) but leave out
  ``app.kubernetes.io/managed-by``: the operator watches managed-by-labelled ConfigMaps as
  children it restores, and a history written every few minutes is not one of those.
* **Bounded**: the value must fit :attr:`StoreSettings.max_bytes` (768 KiB by default; a ConfigMap
  holds at most 1 MiB of data, and the operator's two tiers, 10,080 fine steps and four weeks of
  5 min ones, take about 250 kB at thousands of requests per step).  A history that serialises
  larger is cut to its newest steps, as many as fit (:func:`bounded_dump`): the oldest are dropped
  (the coarse tier's first), a warning says how many, and the in-memory history is left whole.
* **Written** with server-side apply as ``warmpool-operator`` (resourceVersion as a precondition,
  so an object replaced between the read and the write is not overwritten), at most once per
  :attr:`StoreSettings.min_interval_s` (5 min by default) unless forced (the last write before a
  shutdown), and never when nothing changed.  A ConfigMap of that name the WarmModel does not own
  (its owner references lack the WarmModel's uid: a name match is not ownership) is never
  written; it is left byte-for-byte as it is.
* **Loaded** once at start: absent, garbage, or someone else's -> an empty history and the reason,
  logged; at other limits (an older operator's single-resolution 60 s history, another
  ``--predict-step-seconds``) -> re-held at ours, all that can be kept kept
  (:func:`~warmpool_operator.rules.forecast.history_reshape.adapted`: a 60 s week becomes the
  coarse tier's week), logged, and written at ours by the next save; the API server unreachable ->
  empty too, and no write happens until a
  load succeeds (an empty history must never replace a stored one because of a failed read).
  Nothing here raises to the caller.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from warmpool.contract.pods import APP_NAME, LABEL_COMPONENT, LABEL_INSTANCE, LABEL_MODEL, LABEL_NAME
from warmpool.kube import KubeError
from warmpool_operator.io.kube import CONFIGMAPS, Kube
from warmpool_operator.rules.forecast.history import History, HistoryLimits, dumps, loads_or_empty
from warmpool_operator.rules.forecast.history_reshape import adapted, held_steps, oldest_step, since
from warmpool_operator.rules.ownership import owned_by

#: Key of the history ConfigMap holding the serialised history (predict/history.py's format).
CONFIGMAP_KEY_HISTORY = "history"
#: The ConfigMap persisting a WarmModel's request history (operator/warmpool_operator/io/history_store.py).
HISTORY_CONFIGMAP_SUFFIX = "-history"
#: app.kubernetes.io/component of the ConfigMap holding a WarmModel's request history.
COMPONENT_HISTORY = "history"


log = logging.getLogger("warmpool.operator")

#: What the API server accepts in one ConfigMap's data (keys and values together).
CONFIGMAP_DATA_LIMIT = 1024 * 1024


def history_configmap_name(warmmodel: str) -> str:
    """The history ConfigMap's name for a WarmModel (within 63 characters: names are at most 48)."""
    return f"{warmmodel}{HISTORY_CONFIGMAP_SUFFIX}"


def history_labels(warmmodel: str) -> dict[str, str]:
    return {
        LABEL_MODEL: warmmodel,
        LABEL_NAME: APP_NAME,
        LABEL_INSTANCE: warmmodel,
        LABEL_COMPONENT: COMPONENT_HISTORY,
    }


@dataclass(frozen=True)
class StoreSettings:
    """How often and how large the stored history may be."""

    min_interval_s: float = 300.0
    max_bytes: int = 768 * 1024

    def __post_init__(self) -> None:
        if self.min_interval_s < 0:
            raise ValueError(f"min_interval_s must be >= 0, got {self.min_interval_s}")
        limit = CONFIGMAP_DATA_LIMIT - len(CONFIGMAP_KEY_HISTORY)
        if not 0 < self.max_bytes <= limit:
            raise ValueError(f"max_bytes must be within 1..{limit} (a ConfigMap holds 1 MiB), got {self.max_bytes}")


@dataclass(frozen=True)
class LoadResult:
    history: History
    reason: str | None  # why the history starts empty; None when the stored one was loaded


@dataclass(frozen=True)
class SaveResult:
    written: bool
    reason: str  # what happened: written, not due, unchanged, or why nothing was written
    dropped_steps: int = 0  # oldest steps left out to fit max_bytes


def bounded_dump(history: History, max_bytes: int) -> tuple[str | None, int]:
    """(text within ``max_bytes``, oldest steps dropped to get there); (None, all) if not even one fine step fits.

    The whole history when it fits; else only the steps from some time on, as many as fit, found by
    bisection over that time (in fine steps; the coarse tier reaches further back, so its oldest
    steps go first; the compressed size grows with the steps held; zlib's small wobbles can cost a
    step or two).  The steps dropped are counted in both tiers.
    """
    text = dumps(history)
    if len(text) <= max_bytes:
        return text, 0
    too_old, fits = oldest_step(history), history.end  # since(too_old) is too large; since(end) holds nothing
    best: str | None = None
    while fits - too_old > 1:
        middle = (too_old + fits) // 2
        candidate = dumps(since(history, middle))
        if len(candidate) <= max_bytes:
            fits, best = middle, candidate
        else:
            too_old = middle
    return best, held_steps(history) - (held_steps(since(history, fits)) if best is not None else 0)


class HistoryStore:
    """Load and save one WarmModel's :class:`History` (one store per WarmModel, one operator acting)."""

    def __init__(
        self,
        kube: Kube,
        owner: Mapping[str, Any],
        limits: HistoryLimits,
        settings: StoreSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        meta = owner.get("metadata") or {}
        self.kube = kube
        self.owner = owner
        self.owner_uid = str(meta.get("uid") or "")
        self.namespace = str(meta.get("namespace") or "")
        self.warmmodel = str(meta.get("name") or "")
        if not (self.owner_uid and self.namespace and self.warmmodel):
            raise ValueError("the owner must be a WarmModel object with metadata.name, namespace and uid")
        self.name = history_configmap_name(self.warmmodel)
        self.limits = limits
        self.settings = settings or StoreSettings()
        self.clock = clock
        self._read = False  # a load reached the API server: writing cannot lose a stored history
        self._last_write: float | None = None
        self._written: str | None = None  # the text the ConfigMap holds as far as we know

    @property
    def where(self) -> str:
        return f"ConfigMap {self.namespace}/{self.name}"

    async def load(self) -> LoadResult:
        """The stored history, or an empty one and the reason (logged); never raises."""
        try:
            live = await self.kube.get(CONFIGMAPS, self.namespace, self.name)
        except Exception as error:  # a load must never stop the operator: start empty, write nothing yet
            return self._empty(f"{self.where} could not be read ({type(error).__name__}: {error}); not written "
                               "until a load succeeds", logging.WARNING)
        self._read = True
        if live is None:
            return self._empty(f"no stored history ({self.where} does not exist)", logging.INFO)
        if not owned_by(live, self.owner_uid):
            return self._empty(f"{self.where} is not owned by WarmModel {self.warmmodel} (uid {self.owner_uid}): "
                               "left alone, and the history is not persisted while it is there", logging.WARNING)
        text = (live.get("data") or {}).get(CONFIGMAP_KEY_HISTORY)
        stored, why = loads_or_empty(text if isinstance(text, str) else None)
        if why is not None:
            return self._empty(f"{self.where}: {why}", logging.WARNING)
        history, kept = adapted(stored, self.limits)
        if history is stored:
            self._written = text
        else:  # an older operator's (or another step's) history: the next save writes it at ours
            log.info("%s: stored history at other limits (%s) re-held at %s: %s", self.where, stored.limits,
                     self.limits, kept)
        log.info("%s: history loaded (%d steps from step %d)", self.where, len(history), history.start)
        return LoadResult(history, None)

    def _empty(self, reason: str, level: int) -> LoadResult:
        log.log(level, "%s; the history starts empty", reason)
        return LoadResult(History(limits=self.limits), reason)

    async def save(self, history: History, *, force: bool = False) -> SaveResult:
        """Write ``history`` if due (or ``force``), bounded, and only into our own ConfigMap; never raises."""
        if not self._read:
            return SaveResult(False, f"{self.where} was never read (no successful load): not overwriting it")
        now = self.clock()
        if not force and self._last_write is not None and now - self._last_write < self.settings.min_interval_s:
            return SaveResult(False, "not due")
        if not held_steps(history):  # a history re-held with its coarse tier only is not empty
            return SaveResult(False, "empty history: nothing to store")
        text, dropped = bounded_dump(history, self.settings.max_bytes)
        if text is None:
            log.warning("%s: not even one step of history fits %d bytes: not written", self.where,
                        self.settings.max_bytes)
            return SaveResult(False, f"not even one step fits {self.settings.max_bytes} bytes", dropped)
        if dropped:
            log.warning("%s: history serialises above %d bytes: the oldest %d of %d steps are left out of it",
                        self.where, self.settings.max_bytes, dropped, held_steps(history))
        if text == self._written:
            return SaveResult(False, "unchanged", dropped)
        try:
            written = await self._write(text)
        except Exception as error:  # the next save tries again; the history in memory is intact
            log.warning("%s: history not written (%s: %s)", self.where, type(error).__name__, error)
            return SaveResult(False, f"write failed: {type(error).__name__}: {error}", dropped)
        if written is not None:
            return SaveResult(False, written, dropped)
        self._last_write, self._written = now, text
        return SaveResult(True, "written", dropped)

    async def _write(self, text: str) -> str | None:
        """None when written; else why not (someone else's object holds the name)."""
        live = await self.kube.get(CONFIGMAPS, self.namespace, self.name)
        desired = self._desired(text)
        if live is None:
            try:
                await self.kube.create(desired)
                return None
            except KubeError as error:
                if error.status != 409:
                    raise
                live = await self.kube.get(CONFIGMAPS, self.namespace, self.name)
                if live is None:
                    raise
        if not owned_by(live, self.owner_uid):
            log.warning("%s is not owned by WarmModel %s: history not written (the object is left as it is)",
                        self.where, self.warmmodel)
            return f"{self.where} is not owned by this WarmModel: left alone"
        # the version read is a precondition: an object replaced since (someone else's now) gets a 409
        desired["metadata"]["resourceVersion"] = (live.get("metadata") or {}).get("resourceVersion")
        await self.kube.apply(desired)
        return None

    def _desired(self, text: str) -> dict[str, Any]:
        desired: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": self.name, "namespace": self.namespace, "labels": history_labels(self.warmmodel)},
            "data": {CONFIGMAP_KEY_HISTORY: text},
        }
        kopf.adopt(desired, owner=self.owner)  # type: ignore[arg-type]
        return desired
