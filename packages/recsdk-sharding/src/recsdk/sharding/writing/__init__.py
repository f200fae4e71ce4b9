"""Writing a directory of a sharded model together: what checkpoints, exports and publications share.

Modules: :mod:`.comm` (``Comm``: the writers' collectives over the host group, each step that may
fail on some ranks run through one failure agreement), :mod:`.atomic_directory` (a directory
written by every rank under a partial name and published by one rename, manifest last),
:mod:`.files` (the files' sizes and CRC-32s, recorded at a write, the checksums shared out over
the ranks and checked by :func:`recsdk.embedding.file_checksum.verify_files`),
:mod:`.hash_modules` (the sharded hash modules a writer reads off the model) and :mod:`.errors`
(``CheckpointError``, raised on the healthy ranks when one fails; ``os_reason``).
"""
