"""recsdk-pipeline."""

__all__: list[str] = []
