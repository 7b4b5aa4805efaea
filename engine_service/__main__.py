from engine_service.front.server import main

main()
