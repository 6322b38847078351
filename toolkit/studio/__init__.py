"""`ftkit studio`: a local web page over the run folders. Every page reads the run folders as they are on
disk and every action builds the command line `ftkit` itself takes (docs/studio.md)."""
