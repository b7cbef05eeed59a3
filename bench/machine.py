"""What machine a benchmark ran on, for its output: figures are compared only on the same CPU.

The same code has run twice as fast on one project machine as on another (bench/cola.py;
docs/benchmarks.md, "COLA against pyCOLA"), so every benchmark prints the CPU beside its figures: the
model, and how its cores are shared (two vCPUs that are hyperthreads of one core halve what a
second thread can add).
"""

from __future__ import annotations

import os
import platform
import subprocess

LSCPU_FIELDS = {"Model name": "model", "CPU family": "family", "Model": "model_number",
                "Thread(s) per core": "threads_per_core", "Core(s) per socket": "cores_per_socket",
                "Hypervisor vendor": "hypervisor"}


def cpu_description() -> dict:
    """``lscpu``'s facts about this CPU (those it reports of LSCPU_FIELDS) and the CPUs this
    process may use; the model from ``platform.processor()`` where lscpu is missing."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        text = ""
    facts = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in LSCPU_FIELDS and LSCPU_FIELDS[name.strip()] not in facts:
            facts[LSCPU_FIELDS[name.strip()]] = value.strip()
    facts.setdefault("model", platform.processor() or "unknown")
    facts["usable_cpus"] = len(os.sched_getaffinity(0))
    return facts


def cpu_line() -> str:
    """One line for a benchmark's output, e.g. 'CPU: AMD EPYC (family 25, model 17), 1 thread(s)
    per core, 2 usable CPUs, KVM'."""
    facts = cpu_description()
    parts = [facts["model"] + (f" (family {facts['family']}, model {facts['model_number']})"
                               if "family" in facts and "model_number" in facts else "")]
    if "threads_per_core" in facts:
        parts.append(f"{facts['threads_per_core']} thread(s) per core")
    parts.append(f"{facts['usable_cpus']} usable CPUs")
    if "hypervisor" in facts:
        parts.append(facts["hypervisor"])
    return "CPU: " + ", ".join(parts)
