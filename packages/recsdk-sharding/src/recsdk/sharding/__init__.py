"""recsdk-sharding."""

__all__: list[str] = []
