from mlx_infer.cli.app import main

main()
