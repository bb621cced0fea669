"""Configuration: the a3.xml reader, typed settings, topology, causality domains, the secret.

Reads files and checks them; opens no socket and no store."""
