"""A training run: the loop of `meshtrain fit`, the ranks it launches, and what keeps it
alive and honest (signals, the watchdog, injected faults, the console and metrics)."""
