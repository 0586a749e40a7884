"""What drives ComfyUI from outside the pack, shared by tests/, bench/ and scripts/ (which never import one
another, nor does this package import them): the ComfyUI host imported in-process, the pack linked into a
server, the server runner, tiny and full-size random models, API prompts, memory readings, the CUDA check."""
