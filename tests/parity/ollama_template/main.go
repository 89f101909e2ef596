// Renders Ollama chat prompts the way Ollama's server does (server/routes.go ChatHandler, template/template.go),
// with Go's text/template: the Modelfile's SYSTEM is prepended when the conversation does not start with a system
// message, consecutive messages of one role are merged with a blank line, and the template is executed with
// missingkey=zero over {System, Messages, Tools, Response}. Stdin: a JSON list of
// {"template", "system", "messages": [{"role", "content"}]}; stdout: a JSON list of rendered strings.
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

type request struct {
	Template string    `json:"template"`
	System   string    `json:"system"`
	Messages []message `json:"messages"`
}

func collate(msgs []message) (string, []*message) {
	var system []string
	var out []*message
	for i := range msgs {
		if msgs[i].Role == "system" {
			system = append(system, msgs[i].Content)
		}
		if len(out) > 0 && out[len(out)-1].Role == msgs[i].Role && msgs[i].Role != "tool" {
			out[len(out)-1].Content += "\n\n" + msgs[i].Content
		} else {
			m := msgs[i]
			out = append(out, &m)
		}
	}
	return strings.Join(system, "\n\n"), out
}

func render(r request) (string, error) {
	msgs := r.Messages
	if len(msgs) > 0 && msgs[0].Role != "system" && r.System != "" {
		msgs = append([]message{{Role: "system", Content: r.System}}, msgs...)
	}
	system, collated := collate(msgs)
	t, err := template.New("").Option("missingkey=zero").Parse(r.Template)
	if err != nil {
		return "", err
	}
	var b strings.Builder
	err = t.Execute(&b, map[string]any{"System": system, "Messages": collated, "Tools": nil, "Response": ""})
	return b.String(), err
}

func main() {
	var reqs []request
	if err := json.NewDecoder(os.Stdin).Decode(&reqs); err != nil {
		panic(err)
	}
	out := make([]string, len(reqs))
	for i, r := range reqs {
		s, err := render(r)
		if err != nil {
			os.Stderr.WriteString(err.Error() + "\n")
			os.Exit(1)
		}
		out[i] = s
	}
	json.NewEncoder(os.Stdout).Encode(out)
}
