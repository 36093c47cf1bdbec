"""Surviving failures: elastic restarts, preemption, a lost peer, resumable data order."""
