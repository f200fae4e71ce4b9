"""recsdk-embedding."""

__all__: list[str] = []
