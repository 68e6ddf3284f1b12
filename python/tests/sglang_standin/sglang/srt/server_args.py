"""Stand-in for SGLang's server_args: the flag's closed choices."""
import argparse

DISAGG_TRANSFER_BACKEND_CHOICES = ["mooncake", "nixl", "ascend", "fake", "mori"]


def prepare_server_args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--disaggregation-transfer-backend", choices=DISAGG_TRANSFER_BACKEND_CHOICES, default="mooncake")
    p.add_argument("--model-path")
    return p.parse_args(argv)
