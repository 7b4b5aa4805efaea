from engine_service.server import main

main()
