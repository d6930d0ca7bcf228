"""The engine's KV cache, in one place: the block allocator and its resize plans (blocks.py), the prefix cache
over blocks (prefix_cache.py), the device tensors (tensors.py, or in CUDA virtual memory: vmm.py), and the pool's
start-up sizing (sizing.py). The controller's rules for the pool's size and for KV held back for prefills are the
controller's: controller/pool_rules.py and controller/kv_reservation.py."""
