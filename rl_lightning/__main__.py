from rl_lightning.cli import cli_main

cli_main()
