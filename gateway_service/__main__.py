from gateway_service.server import main

main()
