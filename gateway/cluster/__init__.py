"""The nodes behind the gateway: membership, health, load, breakers and the KV events they send."""
