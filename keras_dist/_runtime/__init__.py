"""The runtime every layer uses: the process group, settings plumbing,
liveness, ``/proc``, job status and the timeline."""
