"""One module per `bench` command, each a parser function (`add_parser`) and its handler."""
