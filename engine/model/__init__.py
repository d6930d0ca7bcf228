"""The model: the Llama forward, attention, CPU kernels, loaders and tokenizer."""
