"""The sidecar beside an external engine (`warmpool worker sidecar`: vLLM, SGLang, TGI): the engine
client, page-cache prefetch of its weights, sleep through the engine's API, and the proxy to it."""
