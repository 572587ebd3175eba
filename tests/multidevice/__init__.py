"""Multi-device checks (several host CPU devices, or an AOT TPU mesh) and their runner."""
