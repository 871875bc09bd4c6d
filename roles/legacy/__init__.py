"""Legacy worker implementation selected by trainer.use_legacy_worker_impl."""
