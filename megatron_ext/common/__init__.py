"""What several megatron_ext features share, owned by none of them (pure os, numpy and torch; never
imports megatron or a feature package): files written through a temporary file and a rename
(:mod:`~megatron_ext.common.safe_files`, :mod:`~megatron_ext.common.temp_names`), a small host tensor
copied to the device without a sync (:mod:`~megatron_ext.common.device_copy`), and where each token of
a micro-batch sits among a router's rows under context and sequence parallelism
(:mod:`~megatron_ext.common.token_positions`)."""
