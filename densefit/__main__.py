from densefit.cli import main

main()
