// Renders an Ollama Modelfile TEMPLATE with Go's text/template, the engine Ollama uses, over the values
// Ollama passes for a chat: .Messages (system messages stay in it) and .System (their contents joined by a
// blank line, as Ollama's collate does). Reads {"template": ..., "messages": [...]} on stdin.
package main

import (
	"encoding/json"
	"os"
	"strings"
	"text/template"
)

type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

func main() {
	var input struct {
		Template string    `json:"template"`
		Messages []message `json:"messages"`
	}
	if err := json.NewDecoder(os.Stdin).Decode(&input); err != nil {
		panic(err)
	}
	var system []string
	for _, m := range input.Messages {
		if m.Role == "system" {
			system = append(system, m.Content)
		}
	}
	tmpl := template.Must(template.New("").Parse(input.Template))
	values := map[string]any{"Messages": input.Messages, "System": strings.Join(system, "\n\n")}
	if err := tmpl.Execute(os.Stdout, values); err != nil {
		panic(err)
	}
}
