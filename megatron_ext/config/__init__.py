"""What every feature's configuration is built on: the feature-config registry (:mod:`.registry`:
``@feature_config``, flag names) and the one typed view of Megatron's own arguments
(:mod:`.megatron_view`). The features' configs live beside each feature (``<feature>/config.py``);
:mod:`megatron_ext.training.feature_configs` gathers them for the entry's flags."""
