"""What only the command line uses: doctor, generate, export of checkpoints, plot, bench-scaling."""
