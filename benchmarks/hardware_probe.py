"""This machine's memory bandwidth and matmul rate, across sizes, as the welcome notebook sees them.

    python benchmarks/hardware_probe.py [--device cpu|cuda|mps]

Small copies fit in cache and run faster than memory allows; small matmuls cannot fill the
cores. ``labkit.hardware.probe`` uses a size past both effects (a 256 MiB copy and a
1024 matmul on a CPU; 1 GiB and 8192 in bf16 on a GPU). BENCHMARKS.md records the output.
"""
from __future__ import annotations

import argparse
import datetime
import platform

import torch

from labkit.device import device_name, get_device
from labkit.hardware import probe_dtype, measure_bandwidth, measure_matmul_rate, probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", help="default: labkit.get_device()")
    device = torch.device(parser.parse_args().device or get_device())
    dtype = probe_dtype(device)
    print(f"{datetime.date.today()}  {device_name(device)}  torch {torch.__version__}  {platform.platform()}")
    print("\ncopy size   bandwidth (GB/s, read + write)")
    for mib in (4, 32, 256, 1024):
        print(f"{mib:>5} MiB   {measure_bandwidth(device, mib << 20) / 1e9:8.1f}")
    print(f"\nmatmul n    {str(dtype).removeprefix('torch.')} GFLOP/s")
    for n in (128, 256, 512, 1024, 2048):
        print(f"{n:>8}   {measure_matmul_rate(device, n, dtype) / 1e9:10.1f}")
    print("\nprobe() three times: bandwidth GB/s, matmul GFLOP/s, ridge FLOP/byte")
    for _ in range(3):
        hw = probe(device)
        print(f"    {hw.bandwidth / 1e9:8.1f} {hw.peak_flops / 1e9:10.1f} {hw.ridge_intensity:8.2f}")


if __name__ == "__main__":
    main()
