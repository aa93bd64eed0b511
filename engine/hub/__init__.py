"""engine.hub: models named by Hugging Face Hub id (``--model org/name[@revision][:QUANT]``) → a local snapshot.
Below engine/loading (which asks it for a local path), above nothing but engine/errors; huggingface_hub loads on
first use, so a local path never imports it.

Pieces (each module's docstring is its design note):
- ref.py             HubRef: what a --model string names (a local path, or org/name[@revision][:QUANT | :file.gguf])
- files.py           which of a repository's files duet fetches (the engine's files; one GGUF by quantization tag)
- cache.py           huggingface_hub's cache layout (blobs/, refs/, snapshots/) read without the network
- resolve.py         a Hub id → one commit and its local snapshot: listing, fetching, pinning, the errors
"""
