"""The built-in engine's worker (`warmpool worker serve`): the engine itself (engine/), continuous
batching, the completions API, sleep, and the start-up sequence (runtime)."""
