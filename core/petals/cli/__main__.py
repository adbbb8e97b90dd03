from petals.cli import main

main()
