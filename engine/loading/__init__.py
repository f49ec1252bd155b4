"""Weights in: a Hugging Face folder (loader.py), llama.cpp's GGUF file (gguf.py), and chapter 07's
quantized linear layers (quantization.py), which replace `nn.Linear` inside the model's layers."""
