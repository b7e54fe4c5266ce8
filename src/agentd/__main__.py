from agentd.cli import main

main()
