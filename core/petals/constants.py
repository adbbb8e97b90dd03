"""Constants of the Petals wire protocol and of this implementation."""

UID_DELIMITER = "."  # block uid = f"{dht_prefix}.{index}"
CHAIN_DELIMITER = " "  # a span of consecutive blocks on one server = uids joined by spaces
MODEL_INDEX_KEY = "_petals.models"  # DHT key under which servers announce the models they serve
