"""Distribution: how a sharded hash module's ids go to their owners and its embeddings come back.

Modules: :mod:`.owner` (which rank owns an id), :mod:`.input_guard` (a batch checked before the
id all-to-alls), :mod:`.kjt_all_to_all` (the ids, lengths and weights in one all-to-all),
:mod:`.input_dist` (host row-wise and table-wise input dists), :mod:`.output_dist` (the pooled
output dists on gloo), :mod:`.shardings` (TorchRec's embedding shardings built from those dists),
:mod:`.mean_pooling` (MEAN bags as SUM kernels and a division after the output dist) and
:mod:`.agreement` (``FailureAgreement``: one rank's failure raised on every rank). The public
names are exported by :mod:`recsdk.sharding`.
"""
