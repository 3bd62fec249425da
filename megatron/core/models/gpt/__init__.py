"""gpt package."""
