"""One module per `kvoffload bench` suite."""
