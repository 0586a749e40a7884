"""INT8 files in ComfyUI's own INT8 format: the format (`checkpoint.py`), Save INT8 Model (`save.py`), Load
Diffusion Model (INT8) (`loader.py`) and ComfyUI 0.38's own save nodes on INT8 models (`core_save.py`). The layers
it reads and writes are the INT8 core's (`nodes.int8.modules`), the ones Quantize Model (INT8) puts in a MODEL."""
