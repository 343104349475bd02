"""Commands over what runs left behind: checkpoints, the model registry, every metric and
event after the fact, and slot-hours used."""
