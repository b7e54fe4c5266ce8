from agenttui.cli import main

main()
