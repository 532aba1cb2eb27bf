"""What every feature's configuration is built on: the feature-config registry and flag names
(:mod:`.registry`) and the one typed view of Megatron's own arguments (:mod:`.megatron_view`)."""
