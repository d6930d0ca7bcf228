"""The engine core: the step loop, scheduler, KV cache and prefix cache, sequences, sampler."""
