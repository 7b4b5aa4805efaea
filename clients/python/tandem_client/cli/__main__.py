from tandem_client.cli import main

main()
