"""Publishing: a sharded model's hash tables written out for serving and for offline use.

Modules: :mod:`.publisher` (``Publisher``: numbered versions, full or deltas, in the format of
:mod:`recsdk.embedding.publication`), :mod:`.publication_files` (what a version holds of the
model: table descriptions, the dense part gathered whole, the table files) and :mod:`.export`
(``export_embeddings``: every id with its row, as Parquet). The directories are written with
:mod:`recsdk.sharding.writing`. The public names are exported by :mod:`recsdk.sharding`.
"""
