"""pipeline_parallel package."""
