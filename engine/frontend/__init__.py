"""The front end of the engine: what turns the core's token ids into the text and logprobs a client sees."""
