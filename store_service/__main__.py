from store_service.server import main

main()
