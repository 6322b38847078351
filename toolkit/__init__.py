"""ftkit: fine-tuning recipes and the small library they are built on."""
