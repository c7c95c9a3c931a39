"""Sources of mlx-infer's CPU kernels (an MLX C++ extension), installed as package data and built on
first use by mlx_infer.kernels.cpu."""
