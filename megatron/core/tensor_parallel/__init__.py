"""tensor_parallel package."""
