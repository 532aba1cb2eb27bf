"""megatron_ext: Megatron-Core extensions for Mixture-of-Experts training.

Self-token padding in the data blender, fp8-family grouped-GEMM alignment in the MoE token dispatcher, and
route-replay buffers bound to Megatron's RouterReplay. Importing this package patches nothing; CPU support
for tests lives in :mod:`megatron_ext.cpu.model_stack`.
"""

__version__ = "0.1.0"
