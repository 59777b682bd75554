"""Traffic splits between model variants, canary plans and automatic rollback."""
