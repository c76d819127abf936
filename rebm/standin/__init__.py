"""Shipped recipes end to end on stand-in data (`python -m rebm.standin`, docs/first_hour.md)."""
